"""One run per output folder: `with RunLock(output_dir): ...` holds an exclusive lock on OUTPUT_DIR/.lock.

The lock is an `flock` on the file, so the kernel drops it when the holder exits in any way (SIGKILL
included): a stale lock file never blocks a resume. A second run on the same folder gets `RunLockError`
naming the first one's process (its pid, host, command and start time are written into the file).
In a multi-host run each process holds its own lock (`.lock` for process 0, `.lock.<i>` for process i):
the processes of one run share the folder, a second run is still refused.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

import jax

__all__ = ["RunLock", "RunLockError"]


class RunLockError(RuntimeError):
    """Another live process holds the output folder's lock."""


class RunLock:
    def __init__(self, output_dir: str | os.PathLike, name: str | None = None):
        if name is None:
            name = ".lock" if jax.process_index() == 0 else f".lock.{jax.process_index()}"
        self.output_dir = Path(output_dir)
        self.path = self.output_dir / name
        self._fd: int | None = None

    def acquire(self) -> "RunLock":
        self.output_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = self._describe(fd)
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise RunLockError(f"output folder {self.output_dir} is in use by another run ({holder}); wait for "
                                   "it to finish, stop it, or choose another output_dir") from None
            raise
        info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                "command": " ".join(sys.argv)}
        os.ftruncate(fd, 0)
        os.write(fd, (json.dumps(info) + "\n").encode())
        self._fd = fd
        return self

    @staticmethod
    def _describe(fd: int) -> str:
        try:
            info = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        except (OSError, ValueError):
            info = {}
        if not info.get("pid"):
            return "process unknown"
        return (f"process {info['pid']} on {info.get('host', '?')}, started {info.get('started', '?')}: "
                f"{info.get('command', '?')}")

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
