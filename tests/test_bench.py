"""`zdsl bench` on lavapipe with the tiny synthetic model, and the llama.cpp comparison script.

The bytes each decoded token moves are checked against hyperparameter arithmetic written out
here (KV: 2 bytes × K and V × attention layers × KV heads × head size per row; delta-net state:
f32 S matrices and conv windows, read and written), not against the code under test.
"""

import importlib.util
import json
import re
from dataclasses import replace
from datetime import datetime
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from zdsl.cli import main
from zdsl.kernels.attention import cache_rows
from zdsl.models.qwen35.file import synth

ROOT = Path(__file__).resolve().parent.parent
CONTEXTS, TOKENS, PROMPT, REPEATS = (16, 200), 4, 3, 2


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("models") / "tiny.gguf"
    hp = synth.write(path, "tiny")
    return path, hp


@pytest.fixture(scope="module")
def tiny_long(tmp_path_factory):
    """The tiny model trained (nominally) for 2^30 tokens, so only the device limits its context."""
    path = tmp_path_factory.mktemp("models") / "tiny-long.gguf"
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(synth.PRESETS, "tiny-long", replace(synth.PRESETS["tiny"], context_length=1 << 30))
        synth.write(path, "tiny-long")
    return path


@pytest.fixture(scope="module")
def report(tiny, tmp_path_factory):
    path, _ = tiny
    out = tmp_path_factory.mktemp("bench")
    assert main(["bench", str(path), "--device", "lavapipe", "--contexts", ",".join(map(str, CONTEXTS)),
                 "--tokens", str(TOKENS), "--prompt", str(PROMPT), "--repeats", str(REPEATS), "--copy-mb", "4",
                 "--out", str(out)]) == 0
    return out, json.loads((out / "bench.json").read_text())


@pytest.mark.device
def test_bench_artifacts_and_structure(report, tiny):
    out, r = report
    path, hp = tiny
    assert r["command"].startswith(f"zdsl bench {path} --contexts 16,200")
    datetime.fromisoformat(r["date"])
    assert r["commit"] is None or isinstance(r["commit"], str)
    assert "llvmpipe" in r["device"]["name"] and r["device"]["driver"] and r["device"]["memory_free_bytes"] > 0
    assert r["model"]["name"] == "tiny.gguf" and r["model"]["layers"] == hp.n_layers
    assert r["settings"] == {**r["settings"], "contexts": list(CONTEXTS), "tokens": TOKENS, "prompt": PROMPT,
                             "repeats": REPEATS}
    assert r["copy_gbps"] > 0 and r["dispatches_per_token"] > 0
    assert [row["context"] for row in r["rows"]] == list(CONTEXTS)
    for row in r["rows"]:
        for key in ("prompt", "decode"):
            s = row[key]
            assert len(s["samples"]) == REPEATS and min(s["samples"]) > 0
            assert s["min"] <= s["median"] <= s["max"] and s["stdev"] >= 0
    md = (out / "bench.md").read_text()
    assert r["device"]["name"] in md and f"`{r['command']}`" in md and "batched prefill" in md
    assert [line.split("|")[1].strip() for line in md.splitlines() if line.startswith("| ") and "context" not in line] \
        == [f"{c:,}" for c in CONTEXTS]
    if importlib.util.find_spec("matplotlib") is None:
        assert not (out / "bench.png").exists()
    else:
        assert (out / "bench.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.device
def test_bench_bytes_ceiling_and_percent_are_consistent(report, tiny):
    _, r = report
    _, hp = tiny
    n_attn = sum(hp.attention)
    n_dn = hp.n_layers - n_attn
    kv_row = 2 * 2 * n_attn * hp.n_kv_heads * hp.head_dim
    ssm, conv = 4 * n_dn * hp.ssm_v_heads * hp.ssm_head_dim ** 2, 4 * n_dn * hp.conv_kernel * hp.conv_channels
    state = ssm + conv  # the conv ring: conv_kernel slots, all but one read and that one written per token
    first, last = r["rows"][0]["bytes_per_token"], r["rows"][-1]["bytes_per_token"]
    assert last["total"] - first["total"] == pytest.approx(kv_row * (CONTEXTS[-1] - CONTEXTS[0]))
    for row in r["rows"]:
        b = row["bytes_per_token"]
        assert b["kv_read"] == pytest.approx(kv_row * (row["context"] + (TOKENS + 1) / 2))
        assert b["kv_written"] == kv_row and b["state"] == 2 * ssm + conv
        assert b["total"] == pytest.approx(b["weights"] + b["kv_read"] + b["kv_written"] + b["state"])
        assert 0 < b["weights"] < r["model"]["weight_bytes"]  # 4 of 16 experts read
        assert row["ceiling_tok_per_s"] == pytest.approx(r["copy_gbps"] * 1e9 / b["total"])
        assert row["pct_of_ceiling"] == pytest.approx(100 * row["decode"]["median"] / row["ceiling_tok_per_s"])
    # the plan is what the graph allocated for the largest context, alignment aside
    plan = r["memory_plan"][-1]
    assert plan["n_ctx"] == CONTEXTS[-1] + max(TOKENS, PROMPT)
    assert plan["KV cache"] == kv_row * cache_rows(plan["n_ctx"]) and plan["recurrent state"] == state
    assert plan["weights"] == r["model"]["weight_bytes"]
    assert plan["total"] <= r["device"]["memory_used_bytes"] <= 1.01 * plan["total"] + (1 << 20)


@pytest.mark.parametrize("contexts, free, message", [
    ("64,100000", 64 << 20, r"this model at --ctx 100512 needs weights .* \+ KV cache 196\.4 MiB \+ .* but llvmpipe .* "
                            r"has 64\.0 MiB free; --ctx \d+ would fit"),
])
def test_bench_refuses_contexts_that_do_not_fit(tiny_long, tmp_path, capsys, monkeypatch, contexts, free, message):
    import re

    from zdsl.runtime.device import Device

    if free is not None:
        monkeypatch.setattr(Device, "memory_available", lambda self: free)
    out = tmp_path / "out"
    assert main(["bench", str(tiny_long), "--device", "lavapipe", "--contexts", contexts, "--out", str(out)]) == 2
    captured = capsys.readouterr()
    assert len(captured.err.strip().splitlines()) == 1 and re.match("error: " + message, captured.err)
    assert "memory plan" in captured.out  # printed before the refusal
    assert not out.exists()


def test_bench_refuses_beyond_trained_context(tiny, capsys):
    assert main(["bench", str(tiny[0]), "--device", "lavapipe", "--contexts", "4000"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: context 4000 plus the timed tokens (4512) exceeds the model's trained context "
                          "of 4096 tokens")


# -- defaults that fit the device ---------------------------------------------------------------

MiB = 1 << 20


@pytest.mark.slow
def test_bench_defaults_fit_lavapipe(tiny, tmp_path, capsys, monkeypatch):
    """`zdsl bench MODEL --device lavapipe` with every default runs: the copy buffers shrink to
    what a CPU device gets (512 MiB would not even bind), the depths to those the tiny model's
    trained context holds, and each reduction is one line saying why."""
    from zdsl.models.qwen35.cli.bench import DEFAULT_CONTEXTS

    path, hp = tiny
    monkeypatch.chdir(tmp_path)
    assert main(["bench", str(path), "--device", "lavapipe"]) == 0
    out = capsys.readouterr().out
    r = json.loads((tmp_path / "bench" / "bench.json").read_text())
    depths = [c for c in map(int, DEFAULT_CONTEXTS.split(",")) if c + 512 <= hp.context_length]
    assert r["settings"]["contexts"] == depths == [row["context"] for row in r["rows"]]
    assert f"contexts {','.join(map(str, depths))} (the model is trained for {hp.context_length:,} tokens; " \
           f"default {DEFAULT_CONTEXTS})" in out
    name = r["device"]["name"]
    assert r["settings"]["copy_bytes"] == 2 * 64 * MiB
    assert f"copy buffers 64 MiB ({name} is a CPU, where 64 MiB measures its memory in less time; default 512)" in out
    assert "--copy-mb 64" in r["command"] and f"--contexts {','.join(map(str, depths))}" in r["command"]


@pytest.mark.parametrize("command", [["bench", "MODEL"], ["bench-kernels"], ["bench-kernels", "--preset", "tiny"]])
@pytest.mark.parametrize("mb", [0, 129, 512])
def test_a_copy_size_lavapipe_cannot_bind_is_one_line(tiny, capsys, command, mb):
    args = [str(tiny[0]) if a == "MODEL" else a for a in command]
    assert main([*args, "--device", "lavapipe", "--copy-mb", str(mb)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert re.fullmatch(rf"error: --copy-mb {mb}: llvmpipe .* binds 1 to 128 MiB per buffer; give a size in that "
                        r"range", err[-1])
    assert [line.startswith("preset tiny: ") for line in err[:-1]] == ([True] if command == ["bench-kernels"] else [])


def test_bench_kernels_defaults_fit_a_cpu(capsys):
    """On lavapipe, a CPU, `zdsl bench-kernels` times the tiny preset's step (the 35b-a3b step's
    weights do not bind there) with copy buffers a CPU measures quickly, and says both."""
    assert main(["bench-kernels", "--device", "lavapipe", "--warmup", "1", "--repeats", "3", "--warm-ms", "10",
                 "--cache-mb", "4", "--kernels", "norm_q8_1,moe_router", "--json"]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert {r["use"] for r in report["results"]} == {"HALVES=False n=256", "f32 K=4 k=256 n_expert=16 rows=1"}
    assert report["copy_bytes"] == 2 * 64 * MiB
    lines = captured.err.splitlines()
    assert re.fullmatch(r"preset tiny: llvmpipe .* is a CPU, and the 35b-a3b step is sized for a GPU "
                        r"\(--preset times others\)", lines[0])
    assert lines[1].startswith("copy buffers 64 MiB (llvmpipe") and len(lines) == 2


@given(st.integers(1, 1 << 34), st.sampled_from(["discrete", "integrated", "cpu"]), st.none() | st.integers(-2, 5000))
def test_copy_size_is_one_the_device_binds(limit, kind, given):
    from types import SimpleNamespace

    from zdsl.device_defaults import COPY_MB, CPU_COPY_MB, copy_mb
    from zdsl.errors import ZdslError

    info = SimpleNamespace(name="dev", max_storage_buffer_range=limit, device_type=kind)
    said = []
    bindable = limit // MiB
    if given is not None and not 1 <= given <= bindable:
        with pytest.raises(ZdslError, match=f"--copy-mb {given}: dev binds 1 to {bindable} MiB per buffer"):
            copy_mb(info, given, said.append)
        return
    mb = copy_mb(info, given, said.append)
    if given is not None:
        assert mb == given and not said
        return
    assert mb == min(COPY_MB, bindable, CPU_COPY_MB if kind == "cpu" else COPY_MB)
    assert said == ([] if mb == COPY_MB else [said[0]])
    if mb < COPY_MB:
        assert said[0].startswith(f"copy buffers {mb} MiB (dev ") and said[0].endswith("; default 512)")
        assert ("is a CPU" in said[0]) == (kind == "cpu" and CPU_COPY_MB < bindable)


@given(st.lists(st.tuples(st.integers(1, 1 << 20), st.booleans()), min_size=1, max_size=5), st.integers(1, 1 << 20))
def test_default_depths_are_those_the_model_and_device_hold(shape, trained):
    from zdsl.models.qwen35.cli.bench import DEFAULT_CONTEXTS, default_rows

    rows = [{"context": n - 1, "n_ctx": n, "fits": fits} for n, fits in sorted(shape)]
    said = []
    kept = default_rows(rows, trained, 3 * MiB, "dev", said.append)
    held = [r for r in rows if r["n_ctx"] <= trained and r["fits"]]
    assert kept == (held or rows[:1])
    if len(held) == len(rows):
        assert not said
        return
    assert said == [said[0]] and said[0].startswith(f"contexts {','.join(str(r['context']) for r in kept)} (")
    assert said[0].endswith(f"; default {DEFAULT_CONTEXTS})")
    assert ("the model is trained for" in said[0]) == any(r["n_ctx"] > trained for r in rows)
    assert ("dev has 3.0 MiB free" in said[0]) == (not all(r["fits"] for r in rows))


# -- scripts/peer_bench.py ---------------------------------------------------------------------------

def _peer():
    spec = importlib.util.spec_from_file_location("peer_bench", ROOT / "scripts" / "peer_bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _llama(n_prompt, n_gen, depth, ts, sd):
    return {"build_commit": "abc1234", "backends": "Vulkan", "gpu_info": "NVIDIA H100 80GB HBM3",
            "model_filename": "/tmp/35b.gguf", "n_prompt": n_prompt, "n_gen": n_gen, "n_depth": depth,
            "avg_ts": ts, "stddev_ts": sd, "samples_ts": [ts]}


CANNED = [_llama(512, 0, 0, 8323.0, 40.0), _llama(0, 128, 0, 137.0, 11.0),
          _llama(512, 0, 4096, 7000.0, 30.0), _llama(0, 128, 4096, 173.0, 5.0)]


def _zdsl(contexts):
    def s(m):
        return {"samples": [m], "median": m, "stdev": 1.0, "min": m, "max": m}
    return {"model": {"path": "/tmp/35b.gguf"}, "device": {"name": "NVIDIA H100 80GB HBM3"},
            "settings": {"contexts": contexts, "tokens": 128, "prompt": 512},
            "rows": [{"context": c, "prompt": s(150.0 + c / 1024), "decode": s(190.0 - c / 1024)} for c in contexts],
            "notes": ["prompt = batched prefill in chunks"]}


def test_peer_merge_puts_both_sides_in_one_table():
    rows = _peer().merge(_zdsl([4096, 32768]), CANNED)
    assert [r["test"] for r in rows] == ["pp512", "tg128", "pp512 @ d4096", "tg128 @ d4096", "pp512 @ d32768",
                                         "tg128 @ d32768"]
    by = {r["test"]: r for r in rows}
    assert by["pp512"]["zdsl"] is None and by["pp512"]["llama"] == (8323.0, 40.0) and by["pp512"]["ratio"] is None
    assert by["tg128 @ d4096"]["zdsl"] == (186.0, 1.0) and by["tg128 @ d4096"]["llama"] == (173.0, 5.0)
    assert by["tg128 @ d4096"]["ratio"] == pytest.approx(186.0 / 173.0)
    assert by["tg128 @ d32768"]["llama"] is None and by["tg128 @ d32768"]["zdsl"] == (158.0, 1.0)


def test_peer_script_reads_saved_outputs(tmp_path, capsys):
    llama = tmp_path / "llama.json"
    llama.write_text("ggml_vulkan: Found 1 Vulkan devices:\n" + json.dumps(CANNED))
    zdsl = tmp_path / "bench.json"
    zdsl.write_text(json.dumps(_zdsl([0, 4096])))
    assert _peer().main(["--model", "/tmp/35b.gguf", "--llama-json", str(llama), "--zdsl-json", str(zdsl)]) == 0
    out = capsys.readouterr().out
    assert "tg128 @ d4096" in out and "1.08×" in out and "vs llama.cpp Vulkan" in out
    assert "zdsl: prompt = batched prefill in chunks" in out  # how zdsl ran its prompt, from its bench.json


def test_peer_script_without_llama_bench(tmp_path, monkeypatch, capsys):
    peer = _peer()
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("LLAMA_BENCH", raising=False)
    assert peer.main(["--model", "x.gguf"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no llama-bench found") and len(err.strip().splitlines()) == 1
    assert peer.main(["--model", "x.gguf", "--llama-bench", str(tmp_path / "nope")]) == 2
    assert "is not an executable file" in capsys.readouterr().err


@given(st.lists(st.tuples(st.sampled_from(["blk.0.a", "blk.1.b", "output"]),
                          st.sampled_from(["k1[X=1]", "k1[X=2]", "k2[Y=1]"]),
                          st.floats(0.001, 1.0)), min_size=1, max_size=12),
       st.dictionaries(st.sampled_from(["k1[X=1]", "k1[X=2]", "k2[Y=1]"]), st.integers(1, 1 << 16)))
def test_profile_sums_code_per_kernel(dispatches, sizes):
    """Each kernel's code per step is the code bytes of the variant of each of its dispatches,
    summed; variants the driver gave no size for add nothing, and with no sizes there is none."""
    from zdsl.models.qwen35.cli.profile import summarize

    timings = [(f"{role}:{variant}", ms) for role, variant, ms in dispatches]
    s = summarize(timings, sizes)
    for name in ("k1", "k2"):
        mine = [v for _, v, _ in dispatches if v.startswith(name + "[")]
        known = [sizes[v] for v in mine if v in sizes]
        if known:
            assert s["kernels"][name]["code_bytes"] == sum(known)
        elif mine:
            assert "code_bytes" not in s["kernels"][name]
    expected = sum(sizes.get(v, 0) for _, v, _ in dispatches)
    assert s.get("code_bytes", 0) == expected and ("code_bytes" in s) == any(v in sizes for _, v, _ in dispatches)
    assert "code_bytes" not in summarize(timings)


@pytest.mark.device
def test_profile_on_lavapipe(tiny, tmp_path):
    """`zdsl profile`: every dispatch of the step timed (medians over the timed steps), phases and
    kernels adding up to the total, the norms and the MoE router found in their phases."""
    path, hp = tiny
    assert main(["profile", str(path), "--device", "lavapipe", "--ctx", "64", "--position", "5", "--steps", "2",
                 "--warm-ms", "0", "--out", str(tmp_path)]) == 0
    p = json.loads((tmp_path / "profile.json").read_text())
    assert p["position"] == 5 and p["steps"] == 2
    assert p["dispatches"] == len(p["top"]) and all(ms > 0 for _, ms in p["top"])
    assert sum(p["phases"].values()) == pytest.approx(p["total_ms"])
    assert sum(k["ms"] for k in p["kernels"].values()) == pytest.approx(p["total_ms"])
    # a norm dispatch before each layer and the head; the router norms the MoE input itself
    assert p["kernels"]["moe_router"]["count"] == hp.n_layers and p["kernels"]["norm_q8_1"]["count"] == hp.n_layers + 1
    assert p["phases"]["moe router"] > 0 and p["phases"]["norms"] > 0
    trace = json.loads((tmp_path / "trace.json").read_text())
    assert len(trace["traceEvents"]) == p["dispatches"]


@pytest.mark.device
def test_profile_and_bench_of_steps_of_several_tokens(tiny, tmp_path):
    """`zdsl profile --step-tokens 3`: one sequence's three tokens in a step, attention one
    launch a stage and the delta-net one launch a layer for all three, three draws; `zdsl bench
    --step-tokens 1,3`: the time of each step and its ratio to the one-token step through the same path."""
    path, hp = tiny
    n_attn = sum(hp.attention)
    assert main(["profile", str(path), "--device", "lavapipe", "--ctx", "64", "--position", "5", "--steps", "2",
                 "--warm-ms", "0", "--step-tokens", "3", "--out", str(tmp_path / "p")]) == 0
    p = json.loads((tmp_path / "p" / "profile.json").read_text())
    kernels = p["kernels"]
    assert kernels["deltanet_step"]["count"] == hp.n_layers - n_attn
    assert [kernels[k]["count"] for k in ("attn_prep", "attn_decode", "attn_combine")] == [n_attn] * 3
    assert kernels["sample_draw"]["count"] == 3 and kernels["moe_router"]["count"] == hp.n_layers
    assert main(["bench", str(path), "--device", "lavapipe", "--contexts", "0", "--tokens", "2", "--prompt", "2",
                 "--repeats", "1", "--copy-mb", "4", "--step-tokens", "3,1", "--out", str(tmp_path / "b")]) == 0
    r = json.loads((tmp_path / "b" / "bench.json").read_text())
    assert r["command"].endswith("--step-tokens 1,3")
    assert [s["tokens"] for s in r["steps"]] == [1, 3] and r["steps"][0]["vs_one_token"] == 1.0
    assert r["steps"][1]["vs_one_token"] == pytest.approx(r["steps"][1]["ms"]["median"] / r["steps"][0]["ms"]["median"])


@pytest.mark.parametrize("args, message", [(["--step-tokens", "0"], "give comma-separated token counts"),
                                           (["--step-tokens", "2,x"], "give comma-separated token counts")])
def test_bench_step_tokens_say_what_is_wrong(tiny, capsys, args, message):
    path, _ = tiny
    assert main(["bench", str(path), "--device", "lavapipe", *args]) != 0
    assert message in capsys.readouterr().err
