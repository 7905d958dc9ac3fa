"""A memory and process-count limit for one sandboxed call, from the kernel's cgroups where this machine offers them.

`CallGroup.create(memory_bytes, max_processes)` makes a cgroup beside this process's own (cgroup v2: memory.max,
pids.max in a child of our cgroup when its subtree delegates those controllers; cgroup v1: one group in each of
the memory and pids hierarchies) or returns None where neither can be written (then only the per-process rlimits
hold: see posttrain.tools.jail). `add(pid)` puts the sandbox's first process in it (its children follow);
`remove()` deletes it once the processes are gone. `cgroup_support()` says which kind this machine gives.
"""

from __future__ import annotations

import os
import time
import uuid

__all__ = ["CallGroup", "cgroup_support"]

ROOT = "/sys/fs/cgroup"


def _own_path(controller: str | None) -> str | None:
    """This process's cgroup path in the v2 hierarchy (controller None) or in a v1 controller's."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, names, path = line.split(":", 2)
        if (controller is None and names == "") or (controller is not None and controller in names.split(",")):
            return path
    return None


def _v2_parent() -> str | None:
    path = _own_path(None)
    if path is None or not os.path.exists(os.path.join(ROOT, "cgroup.controllers")):
        return None
    folder = os.path.join(ROOT, path.lstrip("/"))
    try:
        with open(os.path.join(folder, "cgroup.subtree_control")) as f:
            enabled = f.read().split()
    except OSError:
        return None
    return folder if {"memory", "pids"} <= set(enabled) and os.access(folder, os.W_OK) else None


def _v1_parents() -> dict[str, str] | None:
    out = {}
    for controller in ("memory", "pids"):
        path = _own_path(controller)
        folder = os.path.join(ROOT, controller, (path or "").lstrip("/"))
        if path is None or not os.access(folder, os.W_OK):
            return None
        out[controller] = folder
    return out


def cgroup_support() -> str | None:
    """"v2", "v1" or None: which cgroups a sandboxed call can be limited by on this machine."""
    return "v2" if _v2_parent() else "v1" if _v1_parents() else None


def _write(path: str, value) -> None:
    with open(path, "w") as f:
        f.write(str(value))


class CallGroup:
    """The cgroup folder(s) of one call."""

    def __init__(self, folders: list[str], procs_file: str):
        self.folders, self.procs_file = folders, procs_file

    @classmethod
    def create(cls, memory_bytes: int, max_processes: int) -> "CallGroup | None":
        name = f"posttrain-sandbox-{uuid.uuid4().hex[:12]}"
        group = None
        try:
            parent = _v2_parent()
            if parent is not None:
                folder = os.path.join(parent, name)
                os.mkdir(folder)
                group = cls([folder], "cgroup.procs")
                _write(os.path.join(folder, "memory.max"), memory_bytes)
                if os.path.exists(os.path.join(folder, "memory.swap.max")):
                    _write(os.path.join(folder, "memory.swap.max"), 0)
                _write(os.path.join(folder, "pids.max"), max_processes)
                return group
            parents = _v1_parents()
            if parents is None:
                return None
            group = cls([], "cgroup.procs")
            for controller, parent in parents.items():
                folder = os.path.join(parent, name)
                os.mkdir(folder)
                group.folders.append(folder)
            _write(os.path.join(group.folders[0], "memory.limit_in_bytes"), memory_bytes)
            _write(os.path.join(group.folders[1], "pids.max"), max_processes)
            return group
        except OSError:
            if group is not None:
                group.remove(wait_s=0.0)
            return None

    def add(self, pid: int) -> None:
        for folder in self.folders:
            _write(os.path.join(folder, self.procs_file), pid)

    def remove(self, wait_s: float = 2.0) -> None:
        """Delete the group's folders (a folder is busy until its last process is reaped: retried briefly)."""
        deadline = time.monotonic() + wait_s
        for folder in self.folders:
            while True:
                try:
                    os.rmdir(folder)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.01)
