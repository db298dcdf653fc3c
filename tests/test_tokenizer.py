"""The GGUF tokenizer against llama.cpp's own test vectors, and on synthetic vocabularies.

llama.cpp ships `models/ggml-vocab-<name>.gguf` with `.inp` (texts) and `.out` (token ids it
must produce). They come from the llama-cpp-python source package, downloaded once into
~/.cache/zdsl/ (the test skips only if PyPI cannot be reached).
"""

import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zdsl.errors import ModelError
from zdsl.models.qwen35.file import synth
from zdsl.models.qwen35.file.gguf_file import open_model
from zdsl.models.qwen35.model.tokenizer import Tokenizer
from budget import examples

SDIST = "llama-cpp-python==0.3.36"
VOCABS = ("qwen35", "qwen2")
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "zdsl" / "llama-vocab-0.3.36"
SEP = "\n__ggml_vocab_test__\n"
OFFLINE = re.compile(r"connection|network|resolve|timed out|no matching distribution|could not find a version", re.I)


@pytest.fixture(scope="module")
def vocab_dir(tmp_path_factory):
    wanted = [f"ggml-vocab-{v}.gguf{ext}" for v in VOCABS for ext in ("", ".inp", ".out")]
    if not all((CACHE / w).exists() for w in wanted):
        tmp = tmp_path_factory.mktemp("sdist")
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "-q",
                            SDIST, "-d", str(tmp)], capture_output=True, text=True)
        archives = list(tmp.glob("*.tar.gz"))
        if not archives:
            if OFFLINE.search(r.stderr):
                pytest.skip(f"PyPI is unreachable, cannot fetch llama.cpp's tokenizer vectors ({SDIST})")
            pytest.fail(f"pip download {SDIST} failed: {r.stderr.strip()[-500:]}")
        part = CACHE.with_name(CACHE.name + f".part{os.getpid()}")
        part.mkdir(parents=True, exist_ok=True)
        with tarfile.open(archives[0]) as tar:
            for m in tar.getmembers():
                if m.name.split("/")[-1] in wanted and "/vendor/llama.cpp/models/" in m.name:
                    (part / m.name.split("/")[-1]).write_bytes(tar.extractfile(m).read())
        part.replace(CACHE) if not CACHE.exists() else None
    return CACHE


def _vectors(vocab_dir, name):
    texts = (vocab_dir / f"ggml-vocab-{name}.gguf.inp").read_bytes().decode().split(SEP)
    outs = (vocab_dir / f"ggml-vocab-{name}.gguf.out").read_bytes().decode().split("\n")
    texts = texts[:-1] if texts[-1] == "" else texts
    return [(t, [int(i) for i in o.split()]) for t, o in zip(texts, outs)]


@pytest.mark.parametrize("name", VOCABS)
def test_llamacpp_vectors(vocab_dir, name):
    tok = Tokenizer.from_gguf(vocab_dir / f"ggml-vocab-{name}.gguf")
    assert tok.pre == name
    vectors = _vectors(vocab_dir, name)
    assert len(vectors) >= 40
    for text, ids in vectors:
        assert tok.encode(text) == ids, repr(text)
        assert tok.decode(ids) == text


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tiny.gguf"
    synth.write(path, "tiny", quant="q8_0")
    return Tokenizer.from_model(open_model(path))


def test_synthetic_vocab_shape(synthetic):
    assert synthetic.vocab_size == 1024
    assert synthetic.tokens[synthetic.eos_id] == "<|im_end|>"
    assert len({synthetic.piece(i) for i in range(synthetic.vocab_size) if len(synthetic.piece(i)) == 1}) == 256
    assert len(synthetic.encode("the quick brown fox")) < len("the quick brown fox")  # merges apply


@settings(max_examples=examples(60), deadline=None)
@given(st.text(max_size=60))
def test_synthetic_round_trip(synthetic, text):
    assert synthetic.decode(synthetic.encode(text)) == text


def test_special_tokens(synthetic):
    start = synthetic.token_id("<|im_start|>")
    think = synthetic.token_id("<think>")
    assert synthetic.encode("<|im_start|>user", parse_special=True)[0] == start
    assert start not in synthetic.encode("<|im_start|>user")          # spelled out byte by byte
    assert synthetic.encode("a<think>b")[1] == think                   # user-defined: always matched
    ids = synthetic.encode("<|im_start|>hi", parse_special=True)
    assert synthetic.decode(ids) == "<|im_start|>hi"
    assert synthetic.decode(ids, skip_special=True) == "hi"


def test_chat_template(synthetic):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "<think>\nhm\n</think>\n\nHello"}, {"role": "user", "content": "2+2?"}]
    text = synthetic.apply_chat_template(msgs)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                    "<|im_start|>assistant\nHello<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
                    "<|im_start|>assistant\n<think>\n")
    off = synthetic.apply_chat_template(msgs[1:2], enable_thinking=False)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not synthetic.apply_chat_template(msgs[1:2], add_generation_prompt=False).endswith("assistant\n")
    ids = synthetic.encode(text, parse_special=True)
    assert ids.count(synthetic.token_id("<|im_start|>")) == 5
    with pytest.raises(ModelError, match="chat template failed"):
        synthetic.apply_chat_template([{"role": "wizard", "content": "x"}])


def test_merges_naming_no_token_are_left_out(synthetic, tmp_path):
    """A merge whose parts or result the vocabulary lacks (a damaged file) can never apply:
    llama.cpp reads on, and so does zdsl, encoding exactly as without it."""
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": synthetic.pre,
            "tokenizer.ggml.tokens": synthetic.tokens, "tokenizer.ggml.token_type": synthetic.types}
    clean = Tokenizer(lambda k, d: {**meta, "tokenizer.ggml.merges": synthetic.merges}.get(k, d))
    bad = ["Ġnot_a_token x", "q Ġnot_a_token", "e"]  # unknown parts, and a line that is no pair
    damaged = Tokenizer(lambda k, d: {**meta, "tokenizer.ggml.merges": bad + synthetic.merges}.get(k, d))
    for text in ("the quick brown fox", "Ġnot_a_token", "héllo wörld 123"):
        assert damaged.encode(text) == clean.encode(text) == synthetic.encode(text)
