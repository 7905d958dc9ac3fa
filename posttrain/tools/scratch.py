"""Host folders of sandboxed calls, named by the process that made them, and the sweep of those whose maker is gone.

A python tool call keeps its output files (and, for the kernel sandbox, its new root's mount point) in a folder
under the temporary directory, `posttrain-python-tool-<pid>-<start time>-<random>`, and removes it when the call
ends. A worker killed mid-call (its pool's time limit, an environment's, the run's end) never gets there:
`sweep_stale_folders()`, run when a tool or environment worker starts, removes the folders whose maker is no
longer running (its pid gone, or taken by a later process), and leaves those of live processes (other workers,
other runs on the machine) alone. Folders named the old way (no pid) go once they are an hour old.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time

from posttrain.workers import process_start_time

__all__ = ["PREFIX", "owned_tempdir", "owner_alive", "owner_tag", "sweep_stale_folders"]

PREFIX = "posttrain-python-tool-"
_OWNED = re.compile(r"(\d+)-(\d+)-")
UNOWNED_MAX_AGE_S = 3600.0


def owner_tag() -> str:
    """`<pid>-<start time>` of this process: what names its folders (and cgroups)."""
    pid = os.getpid()
    return f"{pid}-{process_start_time(pid) or 0}"


def owner_alive(tag: str) -> bool | None:
    """Whether the process a `<pid>-<start time>-...` name was made by still runs (None: not such a name)."""
    m = _OWNED.match(tag)
    if m is None:
        return None
    pid, start = int(m.group(1)), m.group(2)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return process_start_time(pid) in (start, None) or start == "0"


def owned_tempdir() -> str:
    """A new folder for one call, named by this process."""
    return tempfile.mkdtemp(prefix=f"{PREFIX}{owner_tag()}-")


def sweep_stale_folders(folder: str | None = None) -> list[str]:
    """Remove the call folders under `folder` (default: the temporary directory) whose maker is gone; their
    paths."""
    folder = folder or tempfile.gettempdir()
    removed = []
    try:
        names = [n for n in os.listdir(folder) if n.startswith(PREFIX)]
    except OSError:
        return removed
    for name in names:
        path = os.path.join(folder, name)
        alive = owner_alive(name[len(PREFIX):])
        try:
            if alive is None and time.time() - os.lstat(path).st_mtime < UNOWNED_MAX_AGE_S:
                continue
        except OSError:
            continue
        if not alive:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed
