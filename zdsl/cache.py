"""Where zdsl keeps what it can rebuild (SPIR-V, pipeline caches, synthetic models, tuning runs).

`$ZDSL_CACHE_DIR` overrides the default `~/.cache/zdsl`. Writes are atomic (temp file + rename),
so a crashed or parallel build never leaves a half-written entry behind. A file can still be
emptied, cut or overwritten afterwards, and a bad entry must cost a rebuild, not every later run:
binary entries carry the SHA-256 of their bytes (`write_entry`), and `read_entry` hands back
only bytes that match it, else warns once naming the file and removes it for the caller to
rebuild. Files kept in their own format (models, tuning databases) are checked by their readers,
which warn through `warn` alike.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

DIGEST = hashlib.sha256().digest_size
_log = logging.getLogger("zdsl")
_warned: set[str] = set()


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


def warn(message: str) -> None:
    """One line on stderr, once per process (through logging: with no handler set up, Python
    prints the bare line)."""
    if message not in _warned:
        _warned.add(message)
        _log.warning("warning: %s", message)


def discard(path: Path, why: str) -> None:
    """Warn that a cache file is bad and remove it, so that it is rebuilt rather than read again."""
    warn(f"cache file {path} {why}; removed, zdsl rebuilds it")
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass    # a read-only cache: the entry is skipped on every read instead


def write_entry(path: Path, data: bytes) -> None:
    """Write `data` as a cache entry: the bytes, then their SHA-256."""
    write_atomic(path, data + hashlib.sha256(data).digest())


def read_entry(path: Path, check: Callable[[bytes], str | None] | None = None) -> bytes | None:
    """The bytes of a cache entry, or None when there is none, or when it is bad: a digest that
    does not match, or a problem `check(bytes)` names (then it is discarded, with one warning)."""
    try:
        blob = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        discard(path, f"cannot be read ({e.strerror})")
        return None
    data = blob[:-DIGEST]
    if len(blob) < DIGEST or hashlib.sha256(data).digest() != blob[-DIGEST:]:
        discard(path, "is empty" if not blob else "is damaged (its checksum does not match)")
        return None
    why = check(data) if check else None
    if why:
        discard(path, why)
        return None
    return data
