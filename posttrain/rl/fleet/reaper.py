"""`python -m posttrain.rl.fleet.reaper PID`: watches process PID's descendants (its local Ray: GCS, raylet,
agents, workers) while PID lives; once PID is gone (e.g. SIGKILLed by a scheduler), terminates those that
are still running. Ray's raylet follows its driver, but its per-node agents would otherwise linger."""

from __future__ import annotations

import os
import signal
import sys
import time


def _stat(pid: int) -> tuple[int, str, int] | None:
    """(ppid, state, start time) of a process, or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            rest = f.read().rsplit(")", 1)[1].split()
        return int(rest[1]), rest[0], int(rest[19])
    except (OSError, IndexError, ValueError):
        return None


def _descendants(root: int) -> dict[int, int]:
    """pid -> start time of every live descendant of `root`."""
    table = {}
    for d in os.listdir("/proc"):
        if d.isdigit() and (s := _stat(int(d))) is not None:
            table[int(d)] = s
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = {}, [root]
    while todo:
        for c in children.get(todo.pop(), []):
            if c != os.getpid() and c not in out:
                out[c] = table[c][2]
                todo.append(c)
    return out


def main(pid: int) -> None:
    seen: dict[int, int] = {}
    while (s := _stat(pid)) is not None and s[1] != "Z":
        seen.update(_descendants(pid))
        time.sleep(0.5)
    time.sleep(1.0)  # let Ray's own shutdown go first
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = [p for p, start in seen.items() if (s := _stat(p)) is not None and s[2] == start and s[1] != "Z"]
        for p in alive:
            try:
                os.kill(p, sig)
            except OSError:
                pass
        if not alive:
            return
        time.sleep(1.0)


if __name__ == "__main__":
    main(int(sys.argv[1]))
