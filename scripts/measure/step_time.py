"""One decode step of a model, timed whole, with the code size of each pipeline it runs
(docs/PERF.md). Run it once per tree, alternating trees, to compare them.

Usage: python3 step_time.py MODEL.gguf [NAME (printed on each line)] [DEVICE (default 0)]

Median over 7 bursts of 64 steps at position 512 (each after 8 warm steps there); the sizes
are the driver's code sizes where it reports them (profile.code_sizes: NVIDIA and RADV do)."""
import statistics
import sys

from zdsl.models.qwen35.cli import in_place
from zdsl.models.qwen35.cli.profile import code_sizes
from zdsl.models.qwen35.file.gguf_file import open_model
from zdsl.models.qwen35.model.graph import DecodeGraph
from zdsl.runtime import open_device

model, name = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else ""
dev = open_device(sys.argv[3] if len(sys.argv) > 3 else "0")
g = DecodeGraph(open_model(model), dev, n_ctx=1024, progress=False)
sizes = code_sizes(dev, [v.label for v in g.chosen.values()])
print(name, "code bytes:", ", ".join(f"{v.label.split('[')[0]} {sizes.get(v.label)}" for v in g.chosen.values()),
      flush=True)
times = [1e3 * in_place.step_ms(g, 512, 8, 64) for _ in range(7)]
print(name, f"step {statistics.median(times):.1f} µs/token (min {min(times):.1f})", flush=True)
g.close()
dev.close()
