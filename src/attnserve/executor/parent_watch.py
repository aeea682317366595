"""`exit_with_parent`: a spawned child (an engine core, a worker rank) ends when its parent
process does, so a killed front end or driver never leaves processes behind."""

from __future__ import annotations

import multiprocessing
import os
import threading
from multiprocessing.connection import wait


def _wait_for_parent() -> None:
    parent = multiprocessing.parent_process()
    if parent is not None:
        wait([parent.sentinel])
        os._exit(1)


def exit_with_parent() -> None:
    """Watch the parent from a daemon thread; once it is gone, end this process (status 1)."""
    threading.Thread(target=_wait_for_parent, name="attnserve-parent-watch", daemon=True).start()
