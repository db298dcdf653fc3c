"""Damaged GGUF files through `zdsl model info` and `zdsl run`: bits flipped in the header, the
metadata and the tensor table, a count or length made huge, the file cut anywhere. Each command
either runs (llama.cpp reads on through much of this: a token string that is no longer UTF-8, a
merge that names no token) or ends in one line on stderr and a non-zero exit; never a traceback,
a crash or a hang. Each command runs in its own process, so a crash or a hang shows as one."""

import struct
import subprocess
import sys

import gguf
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zdsl.models.qwen35.file import synth
from budget import examples

TIMEOUT = 120  # seconds per command: far beyond the ~3 s a tiny model takes, so a miss is a hang


class Original(bytes):
    """The tiny MoE model's bytes, with its regions (start, end): header, metadata, tensor table.
    Short in a failure report."""

    def __repr__(self):
        return f"<tiny.gguf, {len(self):,} bytes, regions {self.regions}>"


@pytest.fixture(scope="module")
def original(tmp_path_factory):
    path = tmp_path_factory.mktemp("fuzz") / "tiny.gguf"
    synth.write(path, "tiny", quant="q4_k_m", seed=1)
    reader = gguf.GGUFReader(str(path))
    table, data_at = min(int(t.field.offset) for t in reader.tensors), int(reader.data_offset)
    del reader
    data = Original(path.read_bytes())
    data.regions = {"header": (0, 24), "metadata": (24, table), "table": (table, data_at)}
    return data


def mutate(data: Original, kind: str, where: float, bits: list[int], value: int) -> bytes:
    """One damage of `kind` at relative place `where` (of the file, or of the region it names)."""
    b, regions = bytearray(data), data.regions
    if kind == "cut":
        return bytes(b[:int(where * len(b))])
    if kind == "huge":  # an 8-byte count, length or offset somewhere before the tensor data
        at = (8 + int(where * (regions["table"][1] - 16))) & ~7
        b[at:at + 8] = struct.pack("<Q", value)
        return bytes(b)
    lo, hi = regions[kind]
    for i, bit in enumerate(bits):  # bits flipped at places spread over the region
        b[lo + int((where + i * 0.618) % 1.0 * (hi - lo))] ^= 1 << bit
    return bytes(b)


def run(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zdsl.cli", *args], capture_output=True, text=True,
                          timeout=TIMEOUT)


@settings(max_examples=examples(20), deadline=None)
@given(kind=st.sampled_from(["header", "metadata", "table", "huge", "cut"]), where=st.floats(0, 1, exclude_max=True),
       bits=st.lists(st.integers(0, 7), min_size=1, max_size=4),
       value=st.sampled_from([2 ** 63 - 1, 2 ** 40, 2 ** 32 + 5, 0xFFFFFFFF]))
@pytest.mark.slow
def test_a_damaged_file_runs_or_ends_in_one_line(original, tmp_path, kind, where, bits, value):
    path = tmp_path / "damaged.gguf"
    path.write_bytes(mutate(original, kind, where, bits, value))
    for args in (("model", "info", str(path)), ("run", str(path), "-p", "hi", "-n", "2", "--ctx", "64", "--temp", "0")):
        r = run(*args)
        assert "Traceback" not in r.stderr, (kind, args[0], r.stderr[-2000:])
        assert r.returncode >= 0, (kind, args[0], f"killed by signal {-r.returncode}")
        if r.returncode:
            lines = [line for line in r.stderr.splitlines() if line.strip()]
            assert len(lines) == 1 and lines[0].startswith("error: "), (kind, args[0], r.stderr[-2000:])
