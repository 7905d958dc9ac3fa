"""Worker process pools for user code (tools, rewards): a call whose worker dies, with any status, fails at once.

`StrictProcessPool` is pebble's `ProcessPool` with one difference: pebble reads a worker that exits with status
0 as one retired after `max_tasks` and leaves its running call waiting for its time limit; these pools never
retire workers, so any exit while a call runs (`os._exit(0)`, `sys.exit()` in a C extension, a segfault) fails
that call with `pebble.ProcessExpired` as soon as the pool notices (within its ~0.2 s poll).

`watch_owner(pid)` (run in each worker's initializer) ends the worker within about a second once the process
that owns the pool is gone, even after SIGKILL: workers are children of the fork server, so nothing else tells
them, and one busy in a hanging call would otherwise outlive the run.
"""

from __future__ import annotations

import os
import threading
import time

import pebble
from pebble.common import ProcessExpired, Result, ResultStatus
from pebble.pool.process import PoolManager

__all__ = ["StrictProcessPool", "process_start_time", "watch_owner"]


class _StrictPoolManager(PoolManager):
    def update_workers(self):
        for pid, worker in list(self.worker_manager.workers.items()):
            if worker.is_alive() or worker.exitcode != 0:
                continue  # alive, or a non-zero exit that pebble itself reports
            task = next((t for t in list(self.task_manager.tasks.values()) if t.worker_id == pid), None)
            if task is not None:
                error = ProcessExpired("Abnormal termination: the worker exited during the call", code=0, pid=pid)
                self.task_manager.task_done(task.id, Result(ResultStatus.ERROR, error))
        super().update_workers()


class StrictProcessPool(pebble.ProcessPool):
    """pebble's `ProcessPool` in which a worker's exit with status 0 during a call fails that call at once."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._pool_manager = _StrictPoolManager(self._context, self._pool_manager.worker_manager.mp_context)


def process_start_time(pid: int) -> str | None:
    """The kernel's start time of `pid` (tells a live process from a later one given the same pid)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[19].decode()
    except (OSError, IndexError):
        return None


def _owner_alive(pid: int, start_time: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return start_time is None or process_start_time(pid) in (start_time, None)


def _watch(pid: int, start_time: str | None, interval_s: float) -> None:
    parent = os.getppid()
    while True:
        time.sleep(interval_s)
        if os.getppid() != parent or not _owner_alive(pid, start_time):
            os._exit(1)


def watch_owner(pid: int, start_time: str | None, interval_s: float = 1.0) -> None:
    """End this worker once process `pid` (started at `start_time`) is gone or this worker's parent changes."""
    threading.Thread(target=_watch, args=(pid, start_time, interval_s), daemon=True, name="owner-watch").start()
