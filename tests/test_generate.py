"""Generation that keeps the conversation in the caches (`zdsl chat`): a turn whose prompt extends
what the caches hold feeds only its new tokens and continues exactly as a fresh run over the
whole conversation would, also when a burst of steps ran past the end-of-turn token and had to be
undone, with penalties and seeded sampling (both carry state from step to step)."""

import pytest

from zdsl.models.qwen35 import synth
from zdsl.models.qwen35.gguf_file import open_model
from zdsl.models.qwen35.generate import Generator
from zdsl.models.qwen35.sampler import SamplerConfig

SAMPLERS = [SamplerConfig(temperature=0),
            SamplerConfig(temperature=0.9, top_k=0, repeat_penalty=1.3, frequency_penalty=0.2, last_n=16, seed=4)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("models") / "tiny.gguf"
    synth.write(path, "tiny", seed=8)
    return open_model(path)


@pytest.mark.parametrize("sampler", SAMPLERS, ids=["greedy", "sampled+penalties"])
def test_second_turn_feeds_only_its_new_tokens(model, device, sampler):
    fresh = Generator(model, device, n_ctx=160, sampler=sampler, progress=False)
    chat = Generator(model, device, n_ctx=160, sampler=sampler, progress=False, keep=True)
    tok = chat.tokenizer
    turn1 = [{"role": "user", "content": "Hello there, who are you?"}]
    ids1 = tok.chat_ids(turn1)
    # the end of turn: a token the model samples 6th (mid-burst: bursts of 8 follow the first)
    free = list(fresh.generate(ids1, 12, stop=False))
    end = free[5]
    assert end not in free[:5]
    fresh.stop_ids = chat.stop_ids = frozenset([end])

    reply = list(chat.generate(ids1, 40))
    assert reply == free[:6] and chat.timings.prompt_tokens == len(ids1)
    assert chat.context == ids1 + reply[:-1]   # the end token was sampled, not fed: the run past it undone
    turn2 = turn1 + [{"role": "assistant", "content": tok.decode(reply[:-1]), "ids": reply[:-1]},
                     {"role": "user", "content": "And what can you do?"}]
    ids2 = tok.chat_ids(turn2)
    assert ids2[:len(chat.context)] == chat.context
    second = list(chat.generate(ids2, 14, stop=False))
    assert chat.timings.reused_tokens == len(ids1) + 5
    assert chat.timings.prompt_tokens == len(ids2) - len(ids1) - 5
    assert second == list(fresh.generate(ids2, 14, stop=False))
    assert fresh.timings.prompt_tokens == len(ids2) and fresh.timings.reused_tokens == 0
    # a prompt that does not extend the context starts over
    third = list(chat.generate(ids1, 6, stop=False))
    assert chat.timings.reused_tokens == 0 and third == free[:6]
    fresh.close()
    chat.close()


def test_chat_ids_keep_the_sampled_tokens(model):
    """The reply's own ids are spliced where the template puts its text, even where encoding the
    text again gives other ids; the rest is the template's rendering, encoded."""
    from zdsl.models.qwen35.tokenizer import Tokenizer

    tok = Tokenizer.from_model(model)
    odd = [tok.token_id("h"), tok.token_id("e"), tok.token_id("y")]   # "hey", not as encoding would cut it
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hey", "ids": odd},
                {"role": "user", "content": "yo"}]
    ids = tok.chat_ids(messages)
    text = tok.apply_chat_template(messages)
    before, after = text.split("hey", 1)
    assert ids == tok.encode(before, parse_special=True) + odd + tok.encode(after, parse_special=True)
    assert tok.decode(ids) == text
