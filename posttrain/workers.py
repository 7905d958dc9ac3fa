"""Worker process pools for user code (tools, rewards): a call whose worker dies, with any status, fails at once.

`StrictProcessPool` is pebble's `ProcessPool` with one difference: pebble reads a worker that exits with status
0 as one retired after `max_tasks` and leaves its running call waiting for its time limit; these pools never
retire workers, so any exit while a call runs (`os._exit(0)`, `sys.exit()` in a C extension, a segfault) fails
that call with `pebble.ProcessExpired` as soon as the pool notices (within its ~0.2 s poll).

`watch_owner(pid)` (run in each worker's initializer) ends the worker within about a second once the process
that owns the pool is gone, even after SIGKILL: workers are children of the fork server, so nothing else tells
them, and one busy in a hanging call would otherwise outlive the run.

`pool_context(kind)` is the multiprocessing context every pool here uses: with the fork server, the modules
each kind of pool registered with `preload(...)` (at import) are imported once in the fork server, whichever pool
starts it first, so that a worker starts in milliseconds (an environment's worker per trajectory: 16 of them in
0.12 s instead of 1.8 s on 2 cores).
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time

from concurrent.futures.process import BrokenProcessPool

import pebble
from pebble.common import ProcessExpired, Result, ResultStatus
from pebble.pool.process import PoolManager

__all__ = ["StrictProcessPool", "pool_context", "preload", "process_start_time", "watch_owner"]

_PRELOAD: list[str] = []


def preload(*modules: str) -> None:
    """Ask for `modules` to be imported in the fork server (when it starts: call this at import time)."""
    _PRELOAD.extend(m for m in modules if m not in _PRELOAD)


def pool_context(kind: str):
    """The multiprocessing context `kind` ("forkserver", "spawn", ...), the fork server set to preload every module
    registered with `preload` (it takes effect if the fork server has not started yet)."""
    ctx = multiprocessing.get_context(kind)
    if kind == "forkserver":
        ctx.set_forkserver_preload(list(_PRELOAD))
    return ctx


class _StrictPoolManager(PoolManager):
    respawn = True

    def update_workers(self):
        for pid, worker in list(self.worker_manager.workers.items()):
            if worker.is_alive() or worker.exitcode != 0:
                continue  # alive, or a non-zero exit that pebble itself reports
            task = next((t for t in list(self.task_manager.tasks.values()) if t.worker_id == pid), None)
            if task is not None:
                error = ProcessExpired("Abnormal termination: the worker exited during the call", code=0, pid=pid)
                self.task_manager.task_done(task.id, Result(ResultStatus.ERROR, error))
        if self.respawn:
            super().update_workers()
            return
        for expiration in self.worker_manager.inspect_workers():  # reported, never replaced
            try:
                self.handle_worker_expiration(expiration)
            except BrokenProcessPool:  # no call was running: nothing to report
                pass


class StrictProcessPool(pebble.ProcessPool):
    """pebble's `ProcessPool` in which a worker's exit with status 0 during a call fails that call at once.
    `respawn=False`: a worker that dies or is killed (past a call's time limit) is not replaced; the pool's
    owner closes it (the worker of an `ObjectHost`, whose object died with it)."""

    def __init__(self, *args, respawn: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self._pool_manager = _StrictPoolManager(self._context, self._pool_manager.worker_manager.mp_context)
        self._pool_manager.respawn = respawn


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
