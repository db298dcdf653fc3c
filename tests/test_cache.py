"""Every kind of file under the cache directory, emptied or damaged, costs a rebuild and one
warning naming it: SPIR-V, kernel variants, pipeline caches, the default model, tuning files."""

import json
import logging
import os
import subprocess
import sys
import uuid

import pytest
from hypothesis import given
from hypothesis import strategies as st

from zdsl.cache import read_entry, write_entry

GLSL = """#version 450
layout(local_size_x = 64) in;
layout(std430, binding = 0) buffer X { float x[]; };
void main() { x[gl_GlobalInvocationID.x] += %s; }
"""


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ZDSL_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def warnings_about(caplog, path) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and str(path) in r.getMessage()]


def only_file(folder):
    files = [p for p in folder.iterdir() if not p.name.startswith(".")]
    assert len(files) == 1, files
    return files[0]


def damages():
    """Ways a file gets damaged: emptied, cut short, one byte changed, replaced by other bytes."""
    return st.one_of(
        st.just(lambda b: b""),
        st.floats(0, 0.999).map(lambda f: lambda b: b[:int(len(b) * f)]),
        st.tuples(st.floats(0, 0.999), st.integers(1, 255)).map(
            lambda t: lambda b: b[:int(len(b) * t[0])] + bytes([b[int(len(b) * t[0])] ^ t[1]]) + b[int(len(b) * t[0]) + 1:]),
        st.binary(min_size=1, max_size=300).map(lambda junk: lambda b: junk),
    )


@given(data=st.binary(max_size=2000), damage=damages())
def test_a_damaged_entry_is_never_handed_back(tmp_path, caplog, data, damage):
    path = tmp_path / f"{uuid.uuid4().hex}.entry"
    write_entry(path, data)
    assert read_entry(path) == data and not warnings_about(caplog, path)
    blob = path.read_bytes()
    damaged = damage(blob)
    if damaged == blob:
        return
    path.write_bytes(damaged)
    assert read_entry(path) is None
    assert len(warnings_about(caplog, path)) == 1 and not path.exists()


@pytest.mark.parametrize("damage, why", [
    (lambda p: p.write_bytes(b""), "is empty"),
    (lambda p: p.write_bytes(p.read_bytes()[:100]), "is damaged"),
    (lambda p: p.write_bytes(b"\x03\x02\x23\x07" + bytes(60)), "is damaged"),
    (lambda p: write_entry(p, bytes(64)), "is not a SPIR-V module"),                  # whole, but not SPIR-V
    (lambda p: write_entry(p, read_entry(p)[:-2]), "is not a SPIR-V module"),         # not whole words
    (lambda p: write_entry(p, b"\x03\x02\x23\x07" + bytes(12)), "is not a SPIR-V module"),  # no full header
])
def test_spirv_entries_are_rebuilt(cache, caplog, damage, why):
    from zdsl.toolchain import compile_cached

    first = compile_cached(GLSL % "1.0")
    assert not first.cached
    entry = only_file(cache / "spirv")
    damage(entry)
    again = compile_cached(GLSL % "1.0")
    assert again.spirv == first.spirv and not again.cached
    assert compile_cached(GLSL % "1.0").cached          # a good entry again
    assert [why in m for m in warnings_about(caplog, entry)] == [True]


def test_pipeline_cache_is_checked_against_the_device(cache, caplog):
    import numpy as np

    from zdsl.runtime import open_device, vk
    from zdsl.runtime.device import Device
    from zdsl.toolchain import compile_glsl

    spirv = compile_glsl(GLSL % "2.0")

    def run_once():
        with open_device("lavapipe") as dev:
            x = dev.upload(np.zeros(64, np.float32))
            seq = dev.sequence()
            seq.dispatch(dev.pipeline(spirv, bindings=["rw"]), 1, [x])
            seq.run()
            assert (x.read(np.float32) == 2).all()

    run_once()
    entry = only_file(cache / "pipelines")
    good = read_entry(entry)
    real = Device._new_pipeline_cache

    def refuse(mp):    # a driver that rejects the data although its header is right
        mp.setattr(Device, "_new_pipeline_cache",
                   lambda self, initial: (vk.VK_ERROR_INITIALIZATION_FAILED, None) if initial else real(self, initial))

    for damage, why in ((lambda mp: entry.write_bytes(b""), "is empty"),
                        (lambda mp: entry.write_bytes(entry.read_bytes()[:-1]), "checksum does not match"),
                        (lambda mp: write_entry(entry, good[:16] + bytes(16) + good[32:]),  # another UUID
                         "another device or driver build"),
                        (lambda mp: write_entry(entry, good[:20]), "too short"),
                        (refuse, "refused by the driver (VK_ERROR_INITIALIZATION_FAILED)")):
        caplog.clear()
        with pytest.MonkeyPatch.context() as mp:
            damage(mp)
            run_once()
        assert [why in m for m in warnings_about(caplog, entry)] == [True]
        assert read_entry(entry) is not None              # rewritten whole at close
    caplog.clear()
    run_once()
    assert not warnings_about(caplog, entry)              # and this device takes it


def test_default_model_is_regenerated(cache, caplog):
    from zdsl.models.qwen35.model.generate import default_model

    path = default_model().path
    size = path.stat().st_size
    path.write_bytes(path.read_bytes()[:size // 2])
    model = default_model()
    assert model.path == path and path.stat().st_size == size and model.hparams.n_layers > 0
    assert ["does not open" in m and "is truncated" in m for m in warnings_about(caplog, path)] == [True]


def test_bad_tuning_files_are_named_and_ignored(tmp_path, caplog):
    from zdsl.autotune.database import Database, Entry

    good = {"device": "10de:2330:NVIDIA", "device_name": "H100", "driver": "1", "kernel": "dmmv",
            "shape": {"k": 2048}, "params": {"ROWS": 2}}
    torn = tmp_path / "torn.json"
    torn.write_text(json.dumps({"entries": [good]})[:40])
    mixed = tmp_path / "mixed.json"
    mixed.write_text(json.dumps({"entries": [good, {**good, "params": 3}, {"kernel": "dmmv"}, [1]]}))
    empty = tmp_path / "empty.json"
    empty.write_text("")
    db = Database([torn, mixed, empty])
    assert [e.params for e in db.entries.values()] == [{"ROWS": 2}]
    assert ["cannot be read" in m for m in warnings_about(caplog, torn)] == [True]
    assert ["3 malformed entries" in m for m in warnings_about(caplog, mixed)] == [True]
    assert ["cannot be read" in m for m in warnings_about(caplog, empty)] == [True]
    db.add(Entry(**{**good, "driver": "2"}))
    db.save(torn)                                          # what `zdsl tune` does: the file is whole again
    caplog.clear()
    assert len(Database([torn]).entries) == 2 and not caplog.records


def test_a_build_over_an_emptied_cache_warns_once_per_file(tmp_path):
    """The command line: each emptied file is one warning line, never a traceback or an error."""
    env = {**os.environ, "ZDSL_CACHE_DIR": str(tmp_path)}
    build = [sys.executable, "-m", "zdsl.cli", "build", "--kernels", "advance", "--no-progress"]
    assert subprocess.run(build, env=env, capture_output=True).returncode == 0
    files = sorted(p for p in tmp_path.rglob("*") if p.is_file())
    assert {p.parent.name for p in files} == {"spirv", "variants"}
    for p in files:
        p.write_bytes(b"")
    again = subprocess.run(build, env=env, capture_output=True, text=True)
    assert again.returncode == 0, again.stderr
    assert sorted(again.stderr.splitlines()) == sorted(
        f"warning: cache file {p} is empty; removed, zdsl rebuilds it" for p in files)
    assert all(p.stat().st_size > 0 for p in files)
