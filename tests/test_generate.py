"""Generation that keeps the conversation in the caches (`zdsl chat`): a turn whose prompt extends
what the caches hold feeds only its new tokens, also when a burst of steps ran past the
end-of-turn token and had to be undone, with penalties and seeded sampling (both carry state from
step to step).

Two references. A chat that never runs past the end (bursts of one step, nothing undone) feeds
the same tokens the same way, so it must sample exactly the same tokens: that holds the undoing
to bit-exactness. A fresh run over the whole conversation feeds the reused tokens as one prompt
chunk instead of as decode steps, which sum in another order: after the second prompt its sampler
state (counter, penalty window) must be equal, its caches, states and logits equal up to rounding
(test_prefill.py's bounds), and greedily it must go on with the same tokens. (On a device with
matrix units a prompt chunk rounds its products to f16 and a decode step to Q8_1, which on these
random models moves the logits by up to half their spread: there test_prefill.py holds each path
to a reference of its own, and this test the sampler state and the undoing.)"""

import numpy as np
import pytest

from zdsl.models.qwen35.file import synth
from zdsl.models.qwen35.file.gguf_file import open_model
from zdsl.models.qwen35.model.generate import Generator
from zdsl.models.qwen35.model.sampler import SamplerConfig

from graph_testing import sampler_state_of, state_of

SAMPLERS = [SamplerConfig(temperature=0),
            SamplerConfig(temperature=0.9, top_k=0, repeat_penalty=1.3, frequency_penalty=0.2, last_n=16, seed=4)]
LOGITS, STATE = 0.08, 0.05  # of the logits' spread, of each state's norm (test_prefill.py)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("models") / "tiny.gguf"
    synth.write(path, "tiny", seed=8)
    return open_model(path)


def snapshot(g):
    return g.logits(), state_of(g), sampler_state_of(g)


@pytest.mark.parametrize("sampler", SAMPLERS, ids=["greedy", "sampled+penalties"])
def test_second_turn_feeds_only_its_new_tokens(model, device, sampler):
    fresh = Generator(model, device, n_ctx=160, sampler=sampler, progress=False)
    tok = fresh.tokenizer
    turn1 = [{"role": "user", "content": "Hello there, who are you?"}]
    ids1 = tok.chat_ids(turn1, enable_thinking=False)
    # the end of turn: a token the model samples 6th (mid-burst: bursts of 8 follow the first)
    free = list(fresh.generate(ids1, 12, stop=False))
    end = free[5]
    assert end not in free[:5]
    # a tool's result after the reply: Qwen3.5's template renders the turn as the prompt had it
    # (its empty thinking too, which a new user message would drop), so the second prompt extends it
    turn2 = turn1 + [{"role": "assistant", "content": tok.decode(free[:5]), "ids": free[:5]},
                     {"role": "tool", "content": "And what can you do?"}]
    ids2 = tok.chat_ids(turn2, enable_thinking=False)

    def chat(burst):
        """Both turns, keeping the caches; the state after the second prompt; the second reply."""
        gen = Generator(model, device, n_ctx=160, sampler=sampler, progress=False, keep=True, burst=burst)
        gen.stop_ids = frozenset([end])
        reply = list(gen.generate(ids1, 40))
        assert reply == free[:6] and gen.timings.prompt_tokens == len(ids1)
        assert gen.context == ids1 + reply[:-1]   # the end token was sampled, not fed: the run past it undone
        first = list(gen.generate(ids2, 1, stop=False))
        assert gen.timings.reused_tokens == len(ids1) + 5
        assert gen.timings.prompt_tokens == len(ids2) - len(ids1) - 5
        after_prompt = snapshot(gen.graph)
        rest = list(gen.generate(ids2 + first, 13, stop=False))
        assert gen.timings.reused_tokens == len(ids2) and gen.timings.prompt_tokens == 1
        # a prompt that does not extend the context starts over
        assert list(gen.generate(ids1, 6, stop=False)) == free[:6] and gen.timings.reused_tokens == 0
        gen.close()
        return after_prompt, first + rest

    (logits, states, sampling), second = chat(8)
    assert chat(1)[1] == second   # nothing undone, the same tokens fed the same way: the same tokens

    g = fresh.graph   # what generate() does with a prompt it cannot continue
    g.reset()
    g.prefill(ids2[:-1])
    first = g.decode(ids2[-1])
    want_logits, want_states, want_sampling = snapshot(g)
    for name, value in want_sampling.items():
        assert np.array_equal(sampling[name], value), f"the sampler's {name}"
    if not g.prefill_units:  # on matrix units a chunk rounds to f16, a step to Q8_1: test_prefill holds each
        assert np.abs(logits - want_logits).max() <= LOGITS * want_logits.std()
        for name, value in want_states.items():
            err = np.linalg.norm(states[name] - value) / max(np.linalg.norm(value), 1e-30)
            assert err <= STATE, f"{name} differs by {err:.3g} of its norm"
        if sampler.greedy:
            assert [first] + g.decode_burst(13) == second
    fresh.close()


def test_chat_ids_keep_the_sampled_tokens(model):
    """The reply's own ids are spliced where the template puts its text, even where encoding the
    text again gives other ids; the rest is the template's rendering, encoded."""
    from zdsl.models.qwen35.model.tokenizer import Tokenizer

    tok = Tokenizer.from_model(model)
    odd = [tok.token_id("h"), tok.token_id("e"), tok.token_id("y")]   # "hey", not as encoding would cut it
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hey", "ids": odd},
                {"role": "user", "content": "yo"}]
    ids = tok.chat_ids(messages)
    text = tok.apply_chat_template(messages)
    before, after = text.split("hey", 1)
    assert ids == tok.encode(before, parse_special=True) + odd + tok.encode(after, parse_special=True)
    assert tok.decode(ids) == text


def test_a_prompt_that_leaves_the_context_resumes_from_a_checkpoint(model, device):
    """A prompt sharing only its start with the context restarts from the latest snapshot within
    the shared tokens (at a chunk boundary, where a prompt fed whole is cut too) and generates
    exactly what a fresh run does; a snapshot past the point of divergence is not used."""
    greedy = SamplerConfig(temperature=0)
    fresh = Generator(model, device, n_ctx=160, sampler=greedy, progress=False, chunk=16)
    kept = Generator(model, device, n_ctx=160, sampler=greedy, progress=False, chunk=16, keep=True,
                     checkpoints=1 << 24)
    rng = np.random.default_rng(3)
    first = rng.integers(0, fresh.tokenizer.vocab_size, 50).tolist()
    second = first[:37] + rng.integers(0, fresh.tokenizer.vocab_size, 20).tolist()
    list(kept.generate(first, 4, stop=False))
    assert kept.checkpoints.positions == [16, 32, 48, 49]   # chunk boundaries and the prompt's end
    out = list(kept.generate(second, 8, stop=False))
    assert kept.timings.reused_tokens == 32 and kept.timings.prompt_tokens == len(second) - 32
    assert out == list(fresh.generate(second, 8, stop=False))
    again = list(kept.generate(second, 8, stop=False))   # the same prompt: from its end's snapshot
    assert again == out and kept.timings.reused_tokens == len(second) - 1
    kept.close()
    fresh.close()


def test_another_sampler_of_the_same_kernels_is_written_not_recorded(model, device):
    """A request's own seed, temperature or top-p (a server's every request) changes the settings
    the recorded kernels read: the step is not recorded again, and the tokens are those of a
    generator made with that sampler; greedy decoding too, on those kernels (top_k = 1). Another
    penalties' window records."""
    first = SamplerConfig(temperature=0.8, top_k=0, seed=1)
    others = [SamplerConfig(temperature=1.3, top_p=0.7, min_p=0.0, seed=5),
              SamplerConfig(temperature=0.6, top_k=5, repeat_penalty=1.0, presence_penalty=0.0, seed=9)]
    gen = Generator(model, device, n_ctx=96, sampler=first, progress=False)
    ids = gen.tokenizer.encode("Once upon a time", parse_special=True)
    recorded = gen.graph.recorded
    list(gen.generate(ids, 4, stop=False))
    for other in others:
        gen.use(other)
        assert gen.graph.recorded == recorded
        got = list(gen.generate(ids, 20, stop=False))
        alone = Generator(model, device, n_ctx=96, sampler=other, progress=False)
        assert got == list(alone.generate(ids, 20, stop=False))
        alone.close()
    greedy = SamplerConfig(temperature=0)  # on the sampling kernels as top_k = 1: the same tokens
    gen.use(greedy)
    assert gen.graph.recorded == recorded
    alone = Generator(model, device, n_ctx=96, sampler=greedy, progress=False)
    assert alone.graph.sampler.kernel_cap == 1
    assert list(gen.generate(ids, 20, stop=False)) == list(alone.generate(ids, 20, stop=False))
    alone.close()
    gen.use(SamplerConfig(temperature=0.8, repeat_penalty=1.2, last_n=8))  # another penalties' window
    assert gen.graph.recorded == recorded + 1
    gen.close()


@pytest.mark.slow
def test_a_first_run_shows_its_compile_stages_and_a_later_run_none(model, tmp_path):
    """`zdsl run` piped: a first run (an empty kernel cache) says a line per compile stage and how
    long until its kernels were ready; the next run, with everything cached, says none of it."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, ZDSL_CACHE_DIR=str(tmp_path))
    args = [sys.executable, "-m", "zdsl.cli", "run", str(model.path), "-p", "hi", "-n", "2", "--temp", "0"]
    first, again = (subprocess.run(args, capture_output=True, text=True, env=env, timeout=600) for _ in range(2))
    assert first.returncode == again.returncode == 0, first.stderr + again.stderr
    lines = first.stderr.splitlines()
    stages = [i for i, line in enumerate(lines) if " compiled in " in line]
    ready = [i for i, line in enumerate(lines) if line.startswith("kernels ready in ")]
    assert stages and ready == [stages[-1] + 1], first.stderr
    assert lines[ready[0]].endswith("(compiled on this first run, then cached)")
    assert "compil" not in again.stderr and "kernels ready" not in again.stderr, again.stderr
