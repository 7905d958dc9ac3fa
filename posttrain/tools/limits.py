"""`PythonLimits`: what one run of model-written code may use, the one record of the python tool's limits. The
sandbox section (`rollout.sandbox`: `posttrain.tools.python_sandbox.SandboxConfig`) extends it, so its keys and
defaults are these, and every backend takes it as it is: the kernel's (`posttrain.tools.jail`), the plain process
(`posttrain.tools.process_sandbox`) and the remote service (`posttrain.tools.remote_sandbox`, which gets `wall_s`
and `memory_mb`)."""

from __future__ import annotations

import dataclasses

__all__ = ["PythonLimits"]


@dataclasses.dataclass(frozen=True)
class PythonLimits:
    """Limits of one `python` tool run (`rollout.sandbox.*`).

    wall_s: seconds of wall-clock time; past it the code is stopped.
    cpu_s: seconds of CPU time.
    memory_mb: MiB of memory (address space per process, and for all of a call's processes where cgroups allow).
    file_mb: MiB of any file it writes, stdout and stderr included.
    max_processes: processes of one call at once.
    work_mb: MiB of its private writable folder.
    cpus: CPU cores a call's processes may keep busy at once (a cgroup CPU quota, where cgroups can be written).
    max_output_bytes: bytes of its stdout (and of its stderr) returned to the model; the rest is cut with a marker.
    """

    wall_s: float = 10.0
    cpu_s: int = 5
    memory_mb: int = 1024
    file_mb: int = 1
    max_processes: int = 32
    work_mb: int = 64
    cpus: float = 1.0
    max_output_bytes: int = 16_384

    def __post_init__(self):
        for f in dataclasses.fields(PythonLimits):
            if not getattr(self, f.name) > 0:
                raise ValueError(f"rollout.sandbox.{f.name} must be > 0, found {getattr(self, f.name)}")

    @property
    def memory_bytes(self) -> int:
        return self.memory_mb << 20

    @property
    def file_bytes(self) -> int:
        return self.file_mb << 20

    @property
    def work_bytes(self) -> int:
        return self.work_mb << 20
