"""The converted-model cache: its root (~/.cache/attnserve, or $ATTNSERVE_CACHE_DIR; it also
holds the built native kernels, `attnserve.native.build`), the lock
that lets one process at a time write into it, and listing and clearing it (`attnserve cache`).

Writers take the root's lock (`locked`), build an entry in a staging directory and rename it
into place, so a reader sees a whole entry or none; under the lock no other writer is running,
so staging directories left by a killed writer are removed then.
"""

from __future__ import annotations

import fcntl
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from attnserve.native.build import CACHE_ENV, cache_root

__all__ = [
    "CACHE_ENV",
    "CacheEntry",
    "cache_entries",
    "cache_root",
    "clear_cache",
    "locked",
    "staging_dir",
]

LOCK_NAME = ".lock"
STAGING_PREFIX = ".staging-"


@dataclass(frozen=True)
class CacheEntry:
    path: Path
    size_bytes: int

    @property
    def finished(self) -> bool:
        """False for a staging directory: a conversion running, or one that was killed."""
        return not self.path.name.startswith(STAGING_PREFIX)


@contextmanager
def locked(root: Path, wait: bool = True) -> Iterator[None]:
    """Hold `root`'s writer lock; with `wait=False`, ValueError if another process holds it."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / LOCK_NAME, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ValueError(
                f"another attnserve process is converting a model into {root}; "
                "try again when it is done"
            ) from None
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def staging_dir(root: Path, name: str) -> Path:
    """A fresh staging directory for the entry `name` (call under `locked(root)`), after
    removing those that killed writers left behind."""
    for entry in cache_entries(root):
        if not entry.finished:
            shutil.rmtree(entry.path, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}{name}-", dir=root))


def cache_entries(root: Path) -> list[CacheEntry]:
    """Everything in the cache but its lock, by name, with its size on disk."""
    if not root.is_dir():
        return []
    return [
        CacheEntry(path, _size(path)) for path in sorted(root.iterdir()) if path.name != LOCK_NAME
    ]


def clear_cache(root: Path) -> list[CacheEntry]:
    """Remove every entry (not while a conversion runs: ValueError); return what was removed."""
    if not root.is_dir():
        return []
    with locked(root, wait=False):
        entries = cache_entries(root)
        for entry in entries:
            if entry.path.is_dir():
                shutil.rmtree(entry.path)
            else:
                entry.path.unlink()
    return entries


def _size(path: Path) -> int:
    if not path.is_dir():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
