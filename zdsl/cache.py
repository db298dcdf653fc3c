"""Where zdsl keeps what it can rebuild (SPIR-V, pipeline caches, synthetic models, tuning runs).

`$ZDSL_CACHE_DIR` overrides the default `~/.cache/zdsl`. Writes are atomic (temp file + rename),
so a crashed or parallel build never leaves a half-written entry behind.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path


def cache_dir(*parts: str) -> Path:
    root = os.environ.get("ZDSL_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "zdsl")
    path = Path(root, *parts)
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def content_key(*parts: str | bytes) -> str:
    """A stable hash of everything that determines an artifact (never Python's hash())."""
    h = hashlib.sha256()
    for p in parts:
        b = p.encode() if isinstance(p, str) else p
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.hexdigest()[:32]
