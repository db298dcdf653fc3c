"""The weights from a GGUF file into their device buffers, as stored (quantized blocks)."""

from __future__ import annotations

import time

import numpy as np

from zdsl.runtime.memory import fmt_bytes
from zdsl.models.qwen35.model.weights import file_ranges


def upload_weights(device, model, tensors, weights: dict, progress: bool, say=None) -> None:
    """Every weight from the file into its buffer: file ranges read by several threads while
    the GPU copies what was read before (Device.upload_file)."""
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    jobs = {}  # by the file that holds them (a head of its own: gguf_file.WithHead)
    for name, t in tensors.tensors.items():
        if t.dequantized:  # parts of two types joined: their values (weights.py)
            values = [model.dequant(part.tensor).reshape(-1) for part in t.parts]
            weights[name].write(np.concatenate(values).astype(np.float32))
            continue
        at = 0
        for file_offset, n in file_ranges(model, t):
            jobs.setdefault(model.path_of(t.parts[0].tensor), []).append((weights[name], at, file_offset, n))
            at += n
    console = Console(stderr=True)
    with Progress(TextColumn("uploading weights"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  transient=True, console=console, disable=not (progress and console.is_terminal)) as bar:
        task = bar.add_task("upload", total=sum(job[3] for part in jobs.values() for job in part))
        start = time.perf_counter()
        for path, part in jobs.items():
            device.upload_file(path, part, lambda n: bar.advance(task, n))
        device.wait_idle()
        seconds = time.perf_counter() - start
    if say:
        total = sum(job[3] for part in jobs.values() for job in part)
        say(f"weights: {fmt_bytes(total)} loaded in {seconds:.2f} s ({total / seconds / 1e9:.1f} GB/s)")
