"""Memory, process-count and CPU limits for one sandboxed call, from the kernel's cgroups where this machine offers them.

`CallGroup.create(memory_bytes, max_processes, cpus)` makes a cgroup beside this process's own (cgroup v2:
memory.max, pids.max and, where the `cpu` controller is delegated too, cpu.max in a child of our cgroup when its
subtree delegates those controllers; cgroup v1: one group in each of the memory and pids hierarchies, and the cpu
one where writable) or returns None where none can be written (then only the per-process rlimits hold: see
posttrain.tools.jail). `add(pid)` puts the sandbox's first process in it (its children follow); `remove()` deletes
it once the processes are gone. `cgroup_support()` says which kind this machine gives, `cgroup_controllers()`
which limits it covers.

Groups are named `posttrain-sandbox-<pid>-<start time>-<random>` after the process that made them:
`sweep_stale_groups()` (run when a tool or environment worker starts) removes those whose maker is gone (a worker
killed mid-call), after killing anything left in them (old-style names without a maker: only when empty).
"""

from __future__ import annotations

import os
import signal
import time
import uuid

from posttrain.tools.scratch import owner_alive, owner_tag

__all__ = ["CallGroup", "cgroup_controllers", "cgroup_support", "sweep_stale_groups"]

ROOT = "/sys/fs/cgroup"
PREFIX = "posttrain-sandbox-"
CPU_PERIOD_US = 100_000


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


def _v2_parent() -> tuple[str, bool] | None:
    """Our v2 cgroup folder when it delegates memory and pids to children we may make, and whether cpu too."""
    path = _own_path(None)
    if path is None or not os.path.exists(os.path.join(ROOT, "cgroup.controllers")):
        return None
    folder = os.path.join(ROOT, path.lstrip("/"))
    try:
        with open(os.path.join(folder, "cgroup.subtree_control")) as f:
            enabled = set(f.read().split())
    except OSError:
        return None
    if {"memory", "pids"} <= enabled and os.access(folder, os.W_OK):
        return folder, "cpu" in enabled
    return None


def _v1_parents() -> dict[str, str] | None:
    """Our folder in each writable v1 hierarchy: memory and pids needed, cpu where it is writable."""
    out = {}
    for controller in ("memory", "pids", "cpu"):
        path = _own_path(controller)
        folder = os.path.join(ROOT, controller, (path or "").lstrip("/"))
        if path is not None and os.access(folder, os.W_OK):
            out[controller] = folder
        elif controller != "cpu":
            return None
    return out


def cgroup_support() -> str | None:
    """"v2", "v1" or None: which cgroups a sandboxed call can be limited by on this machine."""
    return "v2" if _v2_parent() else "v1" if _v1_parents() else None


def cgroup_controllers() -> tuple[str, ...]:
    """The limits a call's cgroup sets here: a subset of ("memory", "pids", "cpu"); () without cgroups."""
    v2 = _v2_parent()
    if v2 is not None:
        return ("memory", "pids") + (("cpu",) if v2[1] else ())
    v1 = _v1_parents()
    return tuple(v1) if v1 is not None else ()


def _write(path: str, value) -> None:
    with open(path, "w") as f:
        f.write(str(value))


class CallGroup:
    """The cgroup folder(s) of one call."""

    def __init__(self, folders: list[str], procs_file: str):
        self.folders, self.procs_file = folders, procs_file

    @classmethod
    def create(cls, memory_bytes: int, max_processes: int, cpus: float = 1.0) -> "CallGroup | None":
        name = f"{PREFIX}{owner_tag()}-{uuid.uuid4().hex[:12]}"
        quota = max(1000, int(cpus * CPU_PERIOD_US))
        group = None
        try:
            v2 = _v2_parent()
            if v2 is not None:
                folder = os.path.join(v2[0], name)
                os.mkdir(folder)
                group = cls([folder], "cgroup.procs")
                _write(os.path.join(folder, "memory.max"), memory_bytes)
                if os.path.exists(os.path.join(folder, "memory.swap.max")):
                    _write(os.path.join(folder, "memory.swap.max"), 0)
                _write(os.path.join(folder, "pids.max"), max_processes)
                if v2[1]:
                    _write(os.path.join(folder, "cpu.max"), f"{quota} {CPU_PERIOD_US}")
                return group
            parents = _v1_parents()
            if parents is None:
                return None
            group = cls([], "cgroup.procs")
            for controller, parent in parents.items():
                folder = os.path.join(parent, name)
                os.mkdir(folder)
                group.folders.append(folder)
                if controller == "memory":
                    _write(os.path.join(folder, "memory.limit_in_bytes"), memory_bytes)
                elif controller == "pids":
                    _write(os.path.join(folder, "pids.max"), max_processes)
                else:
                    _write(os.path.join(folder, "cpu.cfs_period_us"), CPU_PERIOD_US)
                    _write(os.path.join(folder, "cpu.cfs_quota_us"), quota)
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


def _kill_inside(folder: str) -> None:
    if os.path.exists(os.path.join(folder, "cgroup.kill")):
        try:
            _write(os.path.join(folder, "cgroup.kill"), 1)
            return
        except OSError:
            pass
    try:
        with open(os.path.join(folder, "cgroup.procs")) as f:
            pids = [int(x) for x in f.read().split()]
    except OSError:
        return
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def sweep_stale_groups() -> list[str]:
    """Remove the call cgroups beside ours whose maker is gone (killing what is left in them); their paths."""
    v2 = _v2_parent()
    parents = [v2[0]] if v2 is not None else list((_v1_parents() or {}).values())
    stale = []
    for parent in parents:
        try:
            names = [n for n in os.listdir(parent) if n.startswith(PREFIX)]
        except OSError:
            continue
        for name in names:
            alive = owner_alive(name[len(PREFIX):])
            if alive is False:  # its maker is gone: what is left inside is ours to end
                _kill_inside(os.path.join(parent, name))
            if alive is not True:  # (an old-style name: removed only when empty)
                stale.append(os.path.join(parent, name))
    CallGroup(stale, "cgroup.procs").remove(wait_s=1.0 if stale else 0.0)
    return [f for f in stale if not os.path.exists(f)]
